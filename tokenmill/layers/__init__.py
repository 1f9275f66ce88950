"""Building blocks of the transformer: linear, norms, rotary embedding, attention, MLP."""
