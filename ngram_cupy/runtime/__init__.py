"""What every backend runs on: array sides, CUDA launches, CPU threads, streams, argument checks."""
