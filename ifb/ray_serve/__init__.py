"""ifb on Ray Serve: N replicas each owning one engine behind one OpenAI-compatible ingress.

A facade above the runtime, like ifb/llm.py: the runtime never imports Ray, and nothing here is
imported unless `ifb serve` (or `ifb.ray_serve.deploy`) is used. Ray is the `[serve]` extra.

    affinity.py  which replica a prompt should go to: prefix keys, power of two choices (no Ray)
    router.py    Ray Serve's RequestRouter extension point driving affinity.py
    replica.py   the replica deployment: one runtime LLM, its reports as routing stats
    report.py    the typed report a replica publishes, and a replica as the router sees it
    proxy.py     ReplicaSetLLM: the server's EngineClient, forwarding requests to replicas
    aggregate.py the replica set's /health body and /metrics text from the replicas' reports
    ingress.py   the ingress deployment: create_app(ReplicaSetLLM)
    deploy.py    build the Serve application and run it (local Ray or --ray-address)
"""
