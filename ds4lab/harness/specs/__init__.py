"""One module per kernel family; each registers its KernelSpecs on import."""
