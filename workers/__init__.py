"""workers: the model, the rank actors and the engine that steps them in lockstep. No HTTP.

Modules, lowest first:
- `config`: `ModelConfig`, a model's shape read from a Hugging Face `config.json` (per-layer windows).
- `parallel`: the tp group (`torch.distributed`, NCCL or gloo, own rendezvous) and the parallel linears.
- `model`: the decoder (Llama / Qwen2 / Qwen3 / Mistral family) with attention paged through `kvcache`.
- `sampling`: `SamplingParams` and the batched sampler (greedy, temperature, top-k, top-p, seeds).
- `tokenizer`: the byte tokenizer and `tokenizer.json`, chat templates, the incremental detokenizer.
- `loader`: loads a model directory or the built-in random model, each tp rank its slice; KV cache sizing.
- `worker`: `RankWorker`, one rank's actor (model shard + KV cache manager); returns its stats delta per step.
- `engine`: `Engine`, the scheduler and step loop over dp groups; places requests, handles failed ranks.
- `stats_channel`: the engine's end of the stats channel: iterations to the aggregator until acknowledged.
- `errors`: `RequestError` (400), `RequestFailed` (500), `EngineError` (503); no torch, no Ray.
"""
