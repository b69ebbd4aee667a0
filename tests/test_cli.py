"""`baton serve`'s start-up lines from Serve's status (a failed deployment ends it with Serve's
message); a running app is checked against real Serve in test_metrics_e2e."""

from types import SimpleNamespace as NS

from deploy.cli import startup_summary


def _status(app_state: str, message: str = "", **deployments) -> NS:
    deps = {name: NS(replica_states=states) for name, states in deployments.items()}
    return NS(applications={"baton": NS(status=app_state, message=message, deployments=deps)})


def test_starting_replicas_are_counted_apart_from_running_ones():
    line, failed = startup_summary(
        _status("DEPLOYING", Router={"RUNNING": 1}, DecodeServer={"STARTING": 2, "RUNNING": 1}),
        ["baton"])
    assert failed is None
    assert line == "baton deploying: Router 1/1, DecodeServer 1/3 (2 starting)"


def test_a_failed_deployment_carries_serves_message():
    line, failed = startup_summary(
        _status("DEPLOY_FAILED", "DecodeServer: CUDA out of memory", DecodeServer={}),
        ["baton"])
    assert line.startswith("baton deploy_failed: DecodeServer 0/0")
    assert failed == "baton: DecodeServer: CUDA out of memory"
