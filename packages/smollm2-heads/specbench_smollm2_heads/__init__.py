"""The heads specbench trained for SmolLM2-135M-Instruct, one folder per head family beside this file; the
smollm2-135m alias (specbench.models.aliases) finds them here when its source tree's folder is absent."""
