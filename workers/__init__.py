"""workers: what runs inside a rank actor: the model shard, its tp group, its KV cache, its step. No HTTP, and
nothing of the engine's loop (engine/); the engine reaches a rank only through the messages of `step`.

Modules, lowest first (those marked * import no torch, so the engine and the ingress use them):
- `config`*: `ModelConfig` (a model's shape, per-layer windows) and `CacheSettings` (the KV cache settings).
- `sampling_params`*: `SamplingParams`, how one request picks tokens.
- `step`*: the engine<->rank messages: `RankSpec`, `StepPlan` (`NewRequest`, `Work`), `StepResult`.
- `tokenizer`*, `gguf_tokenizer`*: the byte tokenizer and `tokenizer.json`, chat templates, the incremental
  detokenizer; a GGUF file's own tokenizer.
- `gguf_model`*: a GGUF file's config and (dequantized, with numpy) weights; the packaged SmolLM2 default.
- `cost_model`*: what a GPU step costs (a roofline over the batch), the simulated ranks' profiles.
- `model_setting`*: what a `model` setting names, its config checked without weights, its tokenizer.
- `parallel`: the tp group (`torch.distributed`, NCCL or gloo, own rendezvous) and the parallel linears.
- `paged_batch`: one forward pass's sequences and the block-table plans paged attention reads through (with
  the prefixes a decode batch shares from the cache, attended once per group: cascade attention).
- `cpu_kernels`: our CPU kernels (`csrc/`, built with torch's cpp_extension and cached; without a compiler
  the model runs torch's operators): decode attention that reads the cache's blocks in place, and a forward
  pass's small operators fused (norm + residual add, rope, silu * up) with the matmul of a lone row.
- `model`: the decoder (Llama / Qwen2 / Qwen3 / Mistral family) with attention paged through `kvcache`.
- `simulated`: the simulated model (`model=simulated`, docs/simulation.md): sleeps a step's cost, emits a
  hash of the sequence.
- `sampling`: the batched sampler (vLLM's penalties, greedy, temperature, min-p, top-k, top-p, per-draw seeded
  generators).
- `loader`: loads a model directory, a GGUF file, the built-in random model or the simulated one, each tp
  rank its slice; KV cache sizing.
- `worker`: `RankWorker`, one rank's actor: its step, its stats delta, its KV events.
"""
