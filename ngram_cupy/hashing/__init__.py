"""The hash layout and per-token arithmetic of each model family: config, layout, reference."""
