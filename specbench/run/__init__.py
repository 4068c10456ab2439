"""A run: the plan (what can run, before anything loads), the loaded session, the worker that answers a question
with every method, the runner that writes the run folder, Ray scale-out, shard merging, the audits, tuned presets."""
