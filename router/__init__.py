"""The cbserve router: OpenAI-compatible HTTP front, pod discovery, load tracking, goodput-aware
routing and admission control. Torch-free by design (it runs where no model does).

Entry points: `router.app.create_app(config)` and `router.app.run(config)`; flags in `router.flags`.
"""
