"""loadtests package."""
