"""``dflash-train eval``: a drafter's acceptance length on the field's prompt sets.

Rooms: ``sets`` (the public prompt-set files in their own formats, and their wrapping),
``engine`` (vLLM serving the target and drafter, read off its ``/metrics``), ``tau_counting``
(every published way of counting tau, side by side), ``report`` (eval.json, the Markdown
table, the per-position plot) and ``runner`` (sets x thinking x drafters, through our
verifier or the engine).
"""
