"""Layout names and the app configs they stand for.

    colo      one colocated replica (prefill and decode in one engine)
    colo4     four colocated replicas
    1p1d      one prefill replica, one decode replica (disaggregated)
    2p3d      two prefill replicas, three decode replicas
    auto      every layout that fills the GPUs at hand: coloN and each pPdD with p + d = N,
              where N = GPUs / GPUs per replica (on CPU: colo1 and 1p1d)

Every replica, of either role, gets the same ``Resources``; the router gets a quarter CPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

_COLOCATED = re.compile(r"^colo(?:cated)?(\d*)$")
_DISAGG = re.compile(r"^(\d+)p(\d+)d$")
ROUTER_CPUS = 0.25


class Resources(BaseModel):
    """What each replica asks Ray for."""

    model_config = ConfigDict(extra="forbid")

    num_gpus: float = Field(0.0, ge=0)
    num_cpus: float = Field(0.5, ge=0)


@dataclass(frozen=True)
class Layout:
    """``prefill == 0`` is colocated: ``decode`` replicas that prefill for themselves."""

    name: str
    prefill: int
    decode: int

    @property
    def colocated(self) -> bool:
        return self.prefill == 0

    @property
    def replicas(self) -> int:
        return self.prefill + self.decode

    def app_config(self, engine: dict, res: Resources, transfer: dict | None = None,
                   router: dict | None = None) -> dict:
        """The ``BatonConfig`` args of this layout (validate with ``BatonConfig(**...)``)."""
        role = {"num_gpus": res.num_gpus, "num_cpus": res.num_cpus}
        config = {"mode": "colocated" if self.colocated else "disaggregated",
                  "engine": dict(engine), "decode": {**role, "num_replicas": self.decode},
                  "router": {"num_cpus": ROUTER_CPUS, **(router or {})}}
        if not self.colocated:
            config["prefill"] = {**role, "num_replicas": self.prefill}
            config["transfer"] = dict(transfer or {})
        return config

    def needs(self, res: Resources, routers: int = 1) -> dict[str, float]:
        return {"GPU": self.replicas * res.num_gpus,
                "CPU": self.replicas * res.num_cpus + routers * ROUTER_CPUS}


def parse_layout(name: str) -> Layout:
    """``colo``, ``coloN``, ``pPdD`` (case-insensitive); a ValueError names the bad one."""
    key = name.strip().lower()
    if m := _COLOCATED.match(key):
        count = int(m.group(1) or 1)
        if count < 1:
            raise ValueError(f"layout {name!r}: needs at least one replica")
        return Layout(f"colo{count}", 0, count)
    if m := _DISAGG.match(key):
        prefill, decode = int(m.group(1)), int(m.group(2))
        if prefill < 1 or decode < 1:
            raise ValueError(f"layout {name!r}: needs at least one prefill and one decode replica")
        return Layout(f"{prefill}p{decode}d", prefill, decode)
    raise ValueError(f"layout {name!r}: use coloN (colocated ×N) or PpDd (e.g. 1p1d, 2p3d)")


def auto_layouts(num_gpus: float, gpus_per_replica: float) -> list[Layout]:
    """Every layout that uses the GPUs at hand: coloN, then 1p(N-1)d … (N-1)p1d."""
    if gpus_per_replica <= 0 or num_gpus <= 0:
        return [parse_layout("colo1"), parse_layout("1p1d")]
    n = int(num_gpus // gpus_per_replica + 1e-9)
    if n < 1:
        raise ValueError(f"{num_gpus} GPUs hold no replica of {gpus_per_replica} GPUs")
    return [parse_layout(f"colo{n}")] + [parse_layout(f"{p}p{n - p}d") for p in range(1, n)]


def parse_layouts(names: list[str], num_gpus: float, gpus_per_replica: float) -> list[Layout]:
    out: list[Layout] = []
    for name in names:
        out += auto_layouts(num_gpus, gpus_per_replica) if name.lower() == "auto" \
            else [parse_layout(name)]
    if not out:
        raise ValueError("layouts: give at least one")
    return list(dict.fromkeys(out))  # drop repeats, keep the order


def missing_resources(layout: Layout, res: Resources, available: dict,
                      routers: int = 1) -> str | None:
    """Why ``layout`` (with ``routers`` ingress replicas) cannot be placed on a cluster with
    ``available`` resources, or None."""
    for kind, need in layout.needs(res, routers).items():
        have = float(available.get(kind, 0.0))
        if need > have + 1e-9:
            return f"{layout.name} needs {need:g} {kind}s; the cluster has {have:g}"
    return None
