"""`neuron-diffusers serve`: an OpenAI-style image API on global rank 0, every replica of the mesh working at once.

- `request.py`: the request bodies (pydantic) and their checks (uploaded images, LoRA names included), turned into
  the job's `Request`s before anything queues.
- `app.py`: the HTTP routes (FastAPI): generations, edits, kept images, health, readiness, Prometheus metrics; errors
  as JSON bodies.
- `files.py`: the images of `response_format: "url"` kept under `--out` (bounded).
- `scheduler.py`: rank 0's bounded queue and one dispatcher thread per replica.
- `channel.py`: how a task reaches a replica's ranks and its images come back (the process group's store).
- `replica.py`: the loop every rank runs: take the replica's next task, generate it together, answer.
- `liveness.py`: heartbeats through the store, so a rank that dies while the server idles ends it too.
- `command.py`: the command itself (arguments, checks before the process group, start-up, shutdown on SIGTERM).
"""
