"""Reading results: run folders as sources, pandas frames, the metrics, cells per (model, task, temperature),
tables, plots, the report, the regression check and the cross-check against engine mode."""
