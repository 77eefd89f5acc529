"""Training embedding tables: sparse row gradients, row-wise optimizers updating rows in place."""
