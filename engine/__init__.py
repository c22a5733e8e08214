"""engine: the engine replica's loop: it admits and places requests, steps its dp groups of rank actors in
lockstep, restarts a dead group, and forwards every iteration's stats deltas. No torch: what runs inside a
rank is `workers/`, reached only through the torch-free messages of `workers/step.py`.

Modules, lowest first:
- `errors`: the request rules and `RequestError` (400), `RequestFailed` (500), `EngineError` (503),
  `Overloaded` (429).
- `config`: `EngineConfig`, the engine's typed, frozen settings (built once from `deployment.settings`).
- `messages`: what a generate call carries from the ingress through Serve's request router (`GenerateRequest`),
  and the engine's typed answers (`EngineInfo`, `EngineHealth`, `FollowReport`).
- `scheduler`: a dp group's queues, the rule that plans its step, and how its result moves the requests on.
- `kv_index`, `kv_stream`, `kv_publisher`, `routing_record`, `kv_hub`: the block index from the ranks' KV
  events, the /kv_events stream, the same events over ZMQ in vLLM's wire format, the records' `routing` field
  (predicted vs realized reuse), and the hub that feeds the first three from each step.
- `placement`: which dp group a request goes to (kv, least_loaded, round_robin), and the `kv` rule the fleet's
  router shares.
- `ranks`: the rank actors' life cycle: one placement group per dp group; start, tp rendezvous, warm-up, stop.
- `transport`: stepping: every live rank with its group's plan each iteration, over actor calls or one Ray
  Compiled Graph execution; a failed rank's step as a `StepFailure`.
- `recovery`: a down dp group's restart with backoff, the engine's handling of a failed group
  (`GroupRecovery`), and the requests that wait while no group is up.
- `stats_channel`: the engine's end of the stats channel: iterations to the aggregator until acknowledged.
- `lifecycle`: the engine's start (its aggregator checked, a dead predecessor's groups taken over, the rest
  launched and warmed up) and its shutdown.
- `core`: `Engine`, the step loop over dp groups.
- `serve`: `KVFleetEngine`, the engine's Serve deployment around `Engine` (the only module here that imports
  Serve).
"""
