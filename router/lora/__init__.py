"""The router's side of multi-LoRA: which pods serve which adapters (from their load reports),
`/v1/models` cards, and the runtime `/v1/load_lora_adapter` / `/v1/unload_lora_adapter` API that
fans out to every pod of the pools."""
