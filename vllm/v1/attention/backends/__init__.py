"""Package of the deprecated legacy surface (upstream vLLM's import paths); see
``migration_guide.md``, "The legacy surface"."""
