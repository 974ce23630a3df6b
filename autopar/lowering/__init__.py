"""Step 4a, lowering: a plan and the captured graph give each rank its program (stage graphs,
tensor-parallel rewrites, kernel substitution); the engines in ``autopar.runtime`` run programs."""

__all__: list[str] = []
