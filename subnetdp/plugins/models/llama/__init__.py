"""Model plugin ``llama``: ``adapter.py`` (registered name, build, partition, materialise), ``neurons.py`` (neuron-level units)."""
