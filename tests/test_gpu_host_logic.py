"""Host-side logic of the GPU paths, checked without a GPU: CUDA-graph capture sizes, null-block
metadata, padding a batch up to a captured size, and the KV budget of an engine that shares a
GPU."""

import torch

from engine.block_pool import NULL_BLOCK
from engine.cuda_graph import DecodeGraphs, capture_sizes
from engine.forward_context import AttentionMetadata, null_meta


def test_capture_sizes_cover_every_batch_up_to_the_largest():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert all(b - a <= 8 for a, b in zip(sizes, sizes[1:]))


def test_capture_sizes_take_a_speculating_steps_rows():
    """With k proposals a sequence, the rows of 1, 2 and 4 sequences verifying k + 1 each have
    graphs of their own (as vLLM's multiples of 1 + k): no padding rows at those batches."""
    assert capture_sizes(8, step_rows=5) == [1, 2, 4, 5, 8]
    assert capture_sizes(64, step_rows=3) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(8, step_rows=1) == capture_sizes(8)
    assert 10 not in capture_sizes(8, step_rows=5)  # never past the largest


def test_the_staged_page_table_follows_the_rows():
    """``StagedInputs``' layout (its copies need CUDA; the views do not): a size's int32 indptr,
    last-page lengths and pages sit right after its ``4 * size`` int64 words of rows, one after
    another, on the device buffer the graph reads and the pinned one a step is written into."""
    from engine.cuda_graph import StagedInputs
    words = torch.zeros(64, dtype=torch.int64)
    indptr, last, pages = StagedInputs._table(words, 4, 20)
    assert (len(indptr), len(last), len(pages)) == (5, 4, 20)
    indptr.fill_(1)
    last.fill_(2)
    pages.fill_(3)
    t = words.view(torch.int32)
    assert t[:32].eq(0).all()  # the rows' 16 int64 words untouched
    assert t[32:37].eq(1).all() and t[37:41].eq(2).all() and t[41:61].eq(3).all()
    assert t[61:].eq(0).all()


def test_null_meta_points_every_sequence_at_the_null_block():
    meta = null_meta(3, 40, block_size=16)  # 40 tokens: 3 pages, the last holding 8
    assert meta.kv_indptr.tolist() == [0, 3, 6, 9]
    assert meta.kv_indices.tolist() == [NULL_BLOCK] * 9
    assert meta.kv_last_page_len.tolist() == [8, 8, 8]
    assert meta.query_start_loc == [0, 40, 80, 120] and not meta.is_decode_only
    assert null_meta(2, 1, block_size=16).is_decode_only


def test_padded_meta_appends_null_rows():
    i32 = torch.int32
    meta = AttentionMetadata(
        slot_mapping=None, query_start_loc=[0, 1, 2], context_lens=[20, 33],
        kv_indptr=torch.tensor([0, 2, 5], dtype=i32),
        kv_indices=torch.tensor([4, 5, 7, 8, 9], dtype=i32),
        kv_last_page_len=torch.tensor([4, 1], dtype=i32), block_size=16, is_decode_only=True)
    padded = DecodeGraphs._padded_meta(meta, 4)
    assert padded.kv_indptr.tolist() == [0, 2, 5, 6, 7]
    assert padded.kv_indices.tolist() == [4, 5, 7, 8, 9, NULL_BLOCK, NULL_BLOCK]
    assert padded.kv_last_page_len.tolist() == [4, 1, 1, 1]
    assert padded.context_lens == [20, 33, 1, 1] and padded.query_start_loc == [0, 1, 2, 3, 4]
    assert DecodeGraphs._padded_meta(meta, 2) is meta


def test_kv_budget_is_this_engines_share_of_a_shared_gpu(monkeypatch):
    """Two engines with gpu_memory_utilization 0.4 on one 80 GiB GPU: the second, started while
    the first holds its 32 GiB, still gets its own share (less its weights and activations)."""
    from types import SimpleNamespace

    from engine.config import EngineConfig, ModelConfig
    from engine.model_runner import ModelRunner

    gib = 2**30
    cfg = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
                      max_position_embeddings=4096, tie_word_embeddings=True)
    runner = SimpleNamespace(
        device=torch.device("cuda", 0), dtype=torch.bfloat16,
        model=SimpleNamespace(config=cfg),
        config=EngineConfig(gpu_memory_utilization=0.4, max_num_batched_tokens=1024,
                            max_num_seqs=8))
    act = 1024 * (2 * 128 + 4 * 64) * 2 * 2 + 8 * 1000 * 4 * 3
    weights, other_engine = 16 * gib, 32 * gib
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device: (80 * gib - other_engine - weights, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: weights)
    assert ModelRunner._cuda_kv_budget(runner) == 0.4 * 80 * gib - weights - act
    # Never more than is free: a third engine on a full GPU gets nothing to spare.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2 * gib, 80 * gib))
    assert ModelRunner._cuda_kv_budget(runner) == 2 * gib - act


def test_every_qwen3_size_gets_a_decode_kernel_flashinfer_builds():
    """Qwen3-14B's 40:8 heads (group 5) have no CUDA-core decode build: tensor cores; the
    others keep what was measured faster (tensor cores from a group of 4: 4B, 8B, 32B)."""
    from engine.attention.base import CUDA_CORE_DECODE_GROUPS, default_decode_tensor_cores
    from engine.model_source import dummy_names, resolve_model

    chosen = {}
    for name in dummy_names():
        cfg = resolve_model(f"dummy:{name}").config
        tc = default_decode_tensor_cores(cfg.num_attention_heads, cfg.num_key_value_heads)
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        assert tc or group in CUDA_CORE_DECODE_GROUPS
        chosen[name] = tc
    assert chosen == {"Qwen3-0.6B": False, "Qwen3-1.7B": False, "Qwen3-4B": True,
                      "Qwen3-8B": True, "Qwen3-14B": True, "Qwen3-32B": True}
    assert default_decode_tensor_cores(32, 8, fp8_kv=True)  # FP8 cache: measured faster


def test_only_a_few_row_graph_takes_inputs_written_on_the_device():
    """Every size runs Baton's decode attention and takes its inputs staged, but the draft's
    step ahead (``kernels.ahead_inputs``: one program over the rows, built for a few) writes
    only a graph of at most ``MAX_ROWS`` rows; a long step of those goes to FlashInfer's graph,
    which the writer does not feed."""
    from types import SimpleNamespace

    from kernels.decode_attention import MAX_ROWS

    graphs = object.__new__(DecodeGraphs)
    graphs.sizes = capture_sizes(64)
    graphs.staged = SimpleNamespace(words={s: 1 for s in graphs.sizes})
    graphs.long_graphs = {s: None for s in graphs.sizes if s <= MAX_ROWS}
    graphs.backend = SimpleNamespace(long_context_len=lambda n: n > 3072)
    assert [graphs.written_size(n, 100) for n in (1, 3, MAX_ROWS)] == [1, 4, MAX_ROWS]
    assert graphs.written_size(MAX_ROWS + 1, 100) is None
    assert graphs.written_size(40, 100) is None
    assert graphs.written_size(2, 4000) is None
