#!/bin/sh
# HAProxy as a Baton cluster runs it: a one-machine cluster (deploy/ray_env.py names this
# script in RAY_SERVE_HAPROXY_BINARY_PATH) and every node of cluster.yaml's. Ray Serve starts
# HAProxy as `haproxy -db -f CONFIG [...]`, at first and at every reload, from a template this
# script edits before running the real HAProxy (BATON_HAPROXY_BINARY) with the same arguments:
#
# 1. Loopback. The template binds the stats and metrics listeners to every interface
#    (`bind *:PORT`, `bind :PORT`) and has no setting for their host. When the app's HTTP
#    frontend listens on a loopback address, bind those two there as well (a frontend on any
#    other address, a cluster's 0.0.0.0, leaves them as Ray wrote them). On loopback the
#    connect timeout also becomes 250 ms (Ray's setting is whole seconds, 5 by default):
#    HAProxy waits min(connect timeout, 1 s) before retrying a request whose server went away,
#    so a request that met a killed ingress replica was answered by the other one after 1.0 s;
#    a connect on one machine takes microseconds.
# 2. Refusal at HAProxy. For each app backend of the HTTP frontend, a generation request
#    (`.../v1/completions`, `.../v1/chat/completions`) is answered 429 with Retry-After by
#    HAProxy itself, at once, while the backend already holds the app's bound of open requests.
#    The bound and the Retry-After come from the map file `baton-bounds.map` beside the config
#    (`<backend> <bound>:<retry-after seconds>:<until>`), which the app's ingress replicas keep
#    (router/ingress/haproxy.py) and renew every second; an entry past its `until` (epoch
#    seconds: no live replica renews it, e.g. an app that is gone) and a backend without one
#    refuse nothing here. On two
#    saturated cores the ingress's own door answered 1.8-3.7 s after the request was sent,
#    because its HTTP server reached the request only then.
# 3. Retries that work (on any frontend address). Ray's `retry-on conn-failure empty-response`
#    (deploy/ray_env.py) resends a request whose ingress replica closed the connection without
#    answering (it was killed) to another replica, but HAProxy can resend only a request it
#    still holds whole: without `option http-buffer-request` on the HTTP frontend it forwards
#    the request before its body is in the buffer and answers 502 instead (measured: requests
#    sent within ~30 ms of an ingress replica's SIGKILL got 502 or a connection closed without
#    a response; with the option, every one was answered by the other replica).
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
    127.*|localhost|::1|\[::1\])
      sed -i -E -e "s/^([[:space:]]*bind )\*?:([0-9]+)[[:space:]]*$/\1$host:\2/" \
        -e "s/^([[:space:]]*timeout connect )[0-9]+s[[:space:]]*$/\1250ms/" "$config" ;;
  esac
  if ! grep -q "option http-buffer-request" "$config"; then
    sed -i -E "s/^(frontend http_frontend)[[:space:]]*$/\1\n    option http-buffer-request/" "$config"
  fi
  if ! grep -q "baton_generation" "$config"; then
    bounds="$(dirname "$config")/baton-bounds.map"
    [ -e "$bounds" ] || : > "$bounds"
    rules="$config.baton-rules"
    backends=$(awk '/^frontend http_frontend/ { inside = 1; next }
                    /^(frontend|backend|listen) / { inside = 0 }
                    inside && $1 == "use_backend" && $3 == "if" && $4 == "is_" $2 { print $2 }' \
               "$config")
    {
      echo "    # Baton: generation requests refused here while the app holds its bound of open"
      echo "    # requests (deploy/haproxy_local.sh, router/ingress/haproxy.py)"
      echo "    acl baton_generation path_end /v1/completions /v1/chat/completions"
      for name in $backends; do
        entry="str($name),map($bounds)"
        echo "    http-request set-var(txn.baton_bound) $entry,field(1,:) if baton_generation is_$name"
        echo "    http-request set-var(txn.baton_until) $entry,field(3,:) if baton_generation is_$name"
        printf '    http-request return status 429 content-type application/json lf-string "{\\"error\\":{\\"message\\":\\"the server is at capacity (%%[be_conn(%s)] requests open); retry after %%[%s,field(2,:)] s\\",\\"type\\":\\"overloaded_error\\",\\"code\\":429}}" hdr retry-after "%%[%s,field(2,:)]" if baton_generation is_%s { var(txn.baton_bound) -m found } { date,neg,add(txn.baton_until) gt 0 } { be_conn(%s),sub(txn.baton_bound) ge 0 }\n' \
          "$name" "$entry" "$entry" "$name" "$name"
      done
    } > "$rules"
    if [ -n "$backends" ]; then
      # Before the frontend's first use_backend (HAProxy runs http-request rules before any).
      awk -v rules="$rules" '
        /^frontend http_frontend/ { inside = 1 }
        /^(backend|listen) / || (/^frontend / && !/^frontend http_frontend/) { inside = 0 }
        inside && !done && $1 == "use_backend" {
          while ((getline line < rules) > 0) print line
          done = 1
        }
        { print }' "$config" > "$config.baton-tmp" && cat "$config.baton-tmp" > "$config"
      rm -f "$config.baton-tmp"
    fi
    rm -f "$rules"
  fi
fi
exec "${BATON_HAPROXY_BINARY:?BATON_HAPROXY_BINARY must name the HAProxy binary}" "$@"
