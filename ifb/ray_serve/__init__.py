"""ifb on Ray Serve: N replicas each owning one engine behind one OpenAI-compatible ingress.

A facade above the runtime, like ifb/llm.py: the runtime never imports Ray, and nothing here is
imported unless `ifb serve` (or `ifb.ray_serve.deploy`) is used. Ray is the `[serve]` extra.

    affinity.py  which replica a prompt should go to: prefix keys, power of two choices (no Ray)
    router.py    Ray Serve's RequestRouter extension point driving affinity.py
    replica.py   the replica deployment: one runtime LLM, its reports as routing stats
    proxy.py     an LLM-shaped object whose open_streams forward to replicas (for create_app)
    ingress.py   the ingress deployment: create_app(proxy) + aggregated /health and /metrics
    deploy.py    build the Serve application and run it (local Ray or --ray-address)
"""
