"""Reports that show how a model is split: sharding, memory, communication."""
