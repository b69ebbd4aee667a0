"""A sweep's configuration, shared by the sweep (:mod:`loadtests.sweep`, which builds it from
the command line and saves it with the results) and the report (:mod:`loadtests.report`, which
reads it back to rebuild a finished sweep's figures)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loadtests import workloads
from loadtests.layouts import Resources, parse_layout
from loadtests.metrics import Slo

CPU_ENGINE = {"num_blocks": 512, "max_num_seqs": 32}


class SweepConfig(BaseModel):
    """Everything one sweep does; built from the command line and saved with the results."""

    model_config = ConfigDict(extra="forbid")

    model: str = "tiny"
    layouts: list[str]
    rates: list[float] = Field(default_factory=list)
    users: list[int] = Field(default_factory=list)
    duration_s: float = Field(30.0, gt=0)
    drain_s: float = Field(60.0, ge=0)
    protocol: Literal["http", "grpc"] = "http"
    arrival: Literal["poisson", "constant"] = "poisson"
    workload: workloads.WorkloadSpec = Field(default_factory=workloads.WorkloadSpec)
    prompt_format: Literal["auto", "ids", "text"] = "auto"
    slo: Slo
    out: Path
    address: str | None = None
    num_cpus: int | None = Field(None, ge=1)
    resources: Resources = Field(default_factory=Resources)
    engine: dict = Field(default_factory=dict)
    transfer_backend: str = "auto"
    disaggregation: Literal["auto", "always", "never"] = "auto"  # a disaggregated layout's mode
    request_timeout_s: float = Field(300.0, gt=0)
    deploy_timeout_s: float = Field(900.0, gt=0)
    temperature: float = Field(0.0, ge=0)
    # Ingress replicas of each layout's app (RouterConfig.num_replicas): layouts of several GPUs
    # stream more tokens than one ingress replica relays.
    router_replicas: int = Field(1, ge=1)
    # Open loop: locust processes sharing each load (each sends rate/processes on its own seeded
    # schedule, a slice of the workload): one process's parsing of the streams bounds what it
    # measures on fast layouts.
    processes: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _one_load_axis(self) -> "SweepConfig":
        if bool(self.rates) == bool(self.users):
            raise ValueError("give either rates (open loop) or users (closed loop), not both")
        if any(r <= 0 for r in self.rates) or any(u < 1 for u in self.users):
            raise ValueError("rates must be > 0 and users >= 1")
        if not self.layouts:
            raise ValueError("layouts: give at least one")
        for name in self.layouts:
            if name.lower() != "auto":
                parse_layout(name)
        return self

    @model_validator(mode="after")
    def _processes_open_loop(self) -> "SweepConfig":
        if self.processes > 1 and not self.rates:
            raise ValueError("processes > 1 needs an open loop (rates): a closed loop's users "
                             "are one locust process's")
        return self

    @property
    def open_loop(self) -> bool:
        return bool(self.rates)

    def loads(self) -> list[float]:
        return sorted(self.rates) if self.open_loop else sorted(self.users)

    def label(self, load: float) -> str:
        return f"rate_{load:g}" if self.open_loop else f"users_{load:g}"

    def seed_for(self, load: float) -> int:
        """Each load its own seed (workload and arrivals), so no load replays another's
        prompts into the prefix cache; every layout gets the same ones at the same load."""
        return self.workload.seed + 1000 * self.loads().index(load)

    def sender_seed(self, load: float, process: int) -> int:
        """The arrival seed of locust process ``process`` at ``load`` (process 0: seed_for)."""
        return self.seed_for(load) + 104729 * process

    def schedules(self, load: float) -> list[list[float]]:
        """Open loop: each locust process's send times at ``load`` (seconds from its start)."""
        return [workloads.arrival_times(load / self.processes, self.duration_s, self.arrival,
                                        self.sender_seed(load, k))
                for k in range(self.processes)]

    def arrivals(self, load: float) -> list[float]:
        """Open loop: every send time at ``load``, all processes together, in order."""
        return sorted(t for schedule in self.schedules(load) for t in schedule)

    def engine_config(self) -> dict:
        base = CPU_ENGINE if self.resources.num_gpus == 0 else {}
        return {**base, **self.engine, "model": self.model}
