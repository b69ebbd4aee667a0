#!/bin/sh
# HAProxy as a one-machine Baton cluster runs it (deploy/ray_env.py names this script in
# RAY_SERVE_HAPROXY_BINARY_PATH). Ray Serve starts HAProxy as `haproxy -db -f CONFIG [...]`,
# at first and at every reload, from a template that binds the stats and metrics listeners to
# every interface (`bind *:PORT`, `bind :PORT`) and has no setting for their host. When the
# app's HTTP frontend listens on a loopback address, bind those two there as well; then run the
# real HAProxy (BATON_HAPROXY_BINARY) with the same arguments. A frontend on any other address
# (a cluster's 0.0.0.0) leaves the file as Ray wrote it.
config=""
previous=""
for arg in "$@"; do
  [ "$previous" = "-f" ] && config=$arg
  previous=$arg
done
if [ -n "$config" ] && [ -w "$config" ]; then
  host=$(awk '/^frontend http_frontend/ { inside = 1; next }
              /^(frontend|backend|listen) / { inside = 0 }
              inside && $1 == "bind" { sub(/:[0-9]+$/, "", $2); print $2; exit }' "$config")
  case "$host" in
    127.*|localhost)
      sed -i -E "s/^([[:space:]]*bind )\*?:([0-9]+)[[:space:]]*$/\1$host:\2/" "$config" ;;
  esac
fi
exec "${BATON_HAPROXY_BINARY:?BATON_HAPROXY_BINARY must name the HAProxy binary}" "$@"
