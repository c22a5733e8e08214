"""Loading checkpoints (sharded files, bad checkpoints, dtypes) and sizing the KV cache from the model."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvcache import KVCacheManager
from tests.support.model_support import greedy, make_manager, save_hf_model, teacher_forced_logits
from workers.config import CacheSettings
from workers.loader import kv_cache_config, load_model
from workers.model_setting import default_config


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_hf_model("llama", path, seed=2)
    return path


def _copy_config(src, dst, **patch):
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(patch)
    (dst / "config.json").write_text(json.dumps(cfg))


def test_weights_split_over_several_files_load_the_same(ckpt, tmp_path):
    tensors = load_file(str(ckpt / "model.safetensors"))
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[::2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[1::2]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    _copy_config(ckpt, tmp_path)
    a, cfg = load_model(str(ckpt))
    b, _ = load_model(str(tmp_path))
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb), na
    seq = list(range(1, 20))
    torch.testing.assert_close(teacher_forced_logits(a, make_manager(cfg), seq, [19]),
                               teacher_forced_logits(b, make_manager(cfg), seq, [19]), atol=0, rtol=0)


def test_missing_weight_is_named(ckpt, tmp_path):
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _copy_config(ckpt, tmp_path)
    with pytest.raises(ValueError, match=r"lacks 1 weight\(s\).*model.layers.1.mlp.up_proj.weight"):
        load_model(str(tmp_path))


def test_config_and_weights_that_disagree(ckpt, tmp_path):
    (tmp_path / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    _copy_config(ckpt, tmp_path, intermediate_size=128)
    with pytest.raises(ValueError, match="checkpoint shape .* does not match"):
        load_model(str(tmp_path))


def test_directory_without_weights(ckpt, tmp_path):
    _copy_config(ckpt, tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors"):
        load_model(str(tmp_path))


def test_tp_without_a_process_group_fails_clearly(ckpt):
    with pytest.raises(RuntimeError, match="needs torch.distributed"):
        load_model(str(ckpt), tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        load_model(None, tp_size=4)


def test_empty_path_is_the_builtin_model():
    a, cfg_a = load_model("")
    b, cfg_b = load_model(None)
    assert cfg_a == cfg_b == default_config()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_bfloat16_model_and_cache_track_fp32():
    m32, cfg = load_model(None)
    m16, _ = load_model(None, dtype=torch.bfloat16)
    assert m16.dtype == torch.bfloat16 and m16.rotary.inv_freq.dtype == torch.float32
    seq = list(range(60, 100))
    ref = teacher_forced_logits(m32, make_manager(cfg), seq, [25])
    got = teacher_forced_logits(m16, make_manager(cfg, dtype=torch.bfloat16), seq, [25])
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.25 * ref.abs().max()
    assert greedy(m16, make_manager(cfg, dtype=torch.bfloat16), seq, 4)  # runs end to end


def test_kv_cache_config_from_the_model():
    cfg = default_config()
    kc = kv_cache_config(cfg, 2, CacheSettings(tokens_per_block=8, max_seq_len=512, kv_cache_bytes=1 << 20,
                                               host_cache_bytes=1 << 21, enable_block_reuse=False),
                         dtype=torch.bfloat16)
    assert kc.tokens_per_block == 8 and kc.max_seq_len == 512 and kc.gpu_cache_bytes == 1 << 20
    assert kc.host_cache_bytes == 1 << 21 and not kc.enable_block_reuse and kc.device == "cpu"
    assert [(la.layer_id, la.num_kv_heads, la.head_dim, la.dtype, la.window_size) for la in kc.layers] == [
        (i, 1, 32, torch.bfloat16, 64 if i == 1 else None) for i in range(4)]
    mgr = KVCacheManager(kc)
    k, v = mgr.layer_kv(1)
    assert k.shape[1:] == (8, 1, 32) and k.dtype == torch.bfloat16
    # per life cycle n slots with n * (3 full layers + 1 sliding) * 2 * 8 * 1 * 32 * 2 bytes <= 1 MiB
    assert k.shape[0] == (1 << 20) // (4 * 2 * 8 * 32 * 2)


def test_kv_cache_budget_defaults():
    cfg = default_config()
    assert kv_cache_config(cfg, 1, CacheSettings(tokens_per_block=4, max_seq_len=64)).gpu_cache_bytes == 2 << 20
    kc = kv_cache_config(cfg, 1, CacheSettings(tokens_per_block=4, max_seq_len=64, gpu_memory_fraction=0.5),
                         device="cuda:0", free_memory=lambda dev: 1000 if dev == torch.device("cuda:0") else 0)
    assert kc.gpu_cache_bytes == 500 and kc.device == "cuda:0"
    for bad, message in ((dict(gpu_memory_fraction=0.0), "gpu_memory_fraction"),
                         (dict(kv_cache_bytes=-1), "must be >= 0"),
                         (dict(tokens_per_block=0), "tokens_per_block")):
        kw = dict(tokens_per_block=4, max_seq_len=64) | bad
        with pytest.raises(ValueError, match=message):
            kv_cache_config(cfg, 1, CacheSettings(**kw))
    with pytest.raises(ValueError, match="not divisible by tp_size"):
        kv_cache_config(cfg, 3, CacheSettings(tokens_per_block=4, max_seq_len=64))


@pytest.mark.gpu
def test_cuda_model_and_cache_match_cpu():
    cpu, cfg = load_model(None)
    seq = list(range(60, 140))
    ref = teacher_forced_logits(cpu, make_manager(cfg), seq, [30, 17])
    gpu, _ = load_model(None, device="cuda")
    kc = kv_cache_config(cfg, 1, CacheSettings(tokens_per_block=4, max_seq_len=128, gpu_memory_fraction=0.01),
                         device="cuda")
    assert kc.gpu_cache_bytes > 0 and kc.device == "cuda"
    mgr = KVCacheManager(kc)
    assert mgr.layer_kv(0)[0].is_cuda
    got = teacher_forced_logits(gpu, mgr, seq, [30, 17])
    torch.testing.assert_close(got.cpu(), ref, atol=2e-3, rtol=0)  # TF32/reduction order differ on GPU
