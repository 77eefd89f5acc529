"""What ``formats.py`` names, as bytes <-> values: each format's decoders and encoders."""
