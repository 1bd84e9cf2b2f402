"""What the engine records for `ubatch explain`: every decode call, its ubatches and why each KQ-mask cell is hidden."""
