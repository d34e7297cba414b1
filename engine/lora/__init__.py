"""Multi-LoRA: many PEFT adapters on one base model, batched together in every step.

Torch-free here (`config`, `errors`, `stats`) so the CLI, the router and the pods' server
processes can read them; the rest (`adapter`, `layers`, `pack`, `registry`, `slots`, `manager`)
runs in the engine. See docs/architecture.md ("Multi-LoRA") for the life of an adapter.
"""
