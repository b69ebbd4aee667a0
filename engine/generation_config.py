"""A model's recommended sampling, applied where a request leaves a field unset (vLLM's
``generation_config`` and ``override_generation_config``, with their names and meaning).

A checkpoint's ``generation_config.json`` carries what its makers recommend; Qwen3's says
temperature 0.6, top-k 20, top-p 0.95. ``"auto"`` (the default, as vLLM's) reads the model
folder's file; ``"vllm"`` reads none (every unset field keeps Baton's own default, as vLLM's
value of that name keeps vLLM's); any other value is a folder whose file is read. The override
(a dict of the file's names) is laid over what was read. Of the file, the fields a request can
set are taken: ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, and
``max_new_tokens`` as ``max_tokens``, which caps every request's ``max_tokens`` (as vLLM's does).
The values are the file's as written (a ``top_k`` of 50 is used, even where it equals
transformers' own default). Dummy models have no folder: nothing is read for them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

FILE = "generation_config.json"
# The file's fields a request can set (transformers' names), and the request's name of each.
FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def check_override(override: Mapping) -> dict:
    """``override`` with a ValueError naming any key outside :data:`FIELDS`."""
    unknown = sorted(set(override) - set(FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config: unknown {', '.join(unknown)}; "
                         f"known: {', '.join(FIELDS)}")
    return dict(override)


def _read(folder: Path, named: bool) -> dict:
    path = folder / FILE
    if not path.is_file():
        if named:  # a folder the user named must hold the file; the model's may not
            raise ValueError(f"generation_config: no {FILE} in {folder}")
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"generation_config: {path} is not JSON: {e}") from None


def sampling_defaults(model_path: Path | None, generation_config: str = "auto",
                      override: Mapping | None = None) -> dict:
    """The request fields' defaults (their request names: ``temperature``, ..., ``max_tokens``)
    that ``generation_config`` and ``override`` give for a model in ``model_path`` (None: a
    dummy model). Checked as :class:`SamplingParams` (a ValueError naming a bad value)."""
    if generation_config == "vllm":
        config = {}
    elif generation_config == "auto":
        config = _read(model_path, named=False) if model_path is not None else {}
    else:
        config = _read(Path(generation_config), named=True)
    config.update(check_override(override or {}))
    defaults = {FIELDS[k]: v for k, v in config.items() if k in FIELDS and v is not None}
    SamplingParams(**defaults)  # a bad value is refused at start, not at every request
    return defaults


def log_defaults(defaults: Mapping, where: str) -> None:
    """vLLM's start-up warning, so that nobody is surprised that unset fields sample."""
    if defaults:
        log.warning("%s: requests' unset sampling fields take the model's generation config %s "
                    "(generation_config 'vllm' turns it off)", where, dict(defaults))


def resolve(params: Mapping, defaults: Mapping, default_max_tokens: int) -> dict:
    """``params`` (request names; None for unset) with each unset field from ``defaults``,
    else SamplingParams' own; ``max_tokens`` unset is ``default_max_tokens``, and a default
    ``max_tokens`` caps it either way."""
    out = {k: defaults.get(k, SamplingParams.model_fields[k].default) if v is None else v
           for k, v in params.items() if k != "max_tokens"}
    limit = params.get("max_tokens")
    limit = default_max_tokens if limit is None else limit
    if defaults.get("max_tokens") is not None:
        limit = min(limit, defaults["max_tokens"])
    return {**out, "max_tokens": limit}
