"""Files in and out: safetensors checkpoints, atomic writes, the ids command's Parquet pipeline."""
