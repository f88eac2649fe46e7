"""Data: interaction sources, `c2kd prepare`, and the example sets every later stage reads."""
