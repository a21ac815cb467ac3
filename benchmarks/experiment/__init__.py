"""The batching experiment (docs/EXPERIMENT.md): a research tool, not part of the installed
product. Run ``python -m benchmarks.experiment OUT``.

Rooms: ``config`` (its options, typed sections as the trainer's), ``arms`` (each compared
spec's loader pairs and trainer flags), ``target`` and ``textdata`` (the text corpus's
target and prompts), ``run`` (corpora, daemon, one trainer per run), ``served`` and
``humaneval`` (vLLM's and our evaluation's tau of the final drafters), ``analysis``,
``measures``, ``stats``, ``looping`` and ``report`` (the results), ``compare`` (one
spec of one experiment against one of another, paired by seed).

``TRAINER_API`` is all of the trainer it uses: these names of these modules. The trainer
can change anything else without the experiment noticing (``tests/unit/test_layering.py``
reads every import of the package, those inside functions too, to hold it so). A run
itself is a ``dflash-train train`` command line, not an import.
"""

TRAINER_API: dict[str, tuple[str, ...]] = {
    # its options, typed and made into flags as the trainer's are
    "trainer.options": ("Options", "opt"),
    "trainer.cli.flags": ("SectionedCommand", "options_from"),
    # a run's options, metrics and checkpoints, read back
    "trainer.sections": ("RunOptions",),
    "trainer.train.metrics": ("metrics_path", "read_metrics"),
    "trainer.train.checkpoint": (
        "checkpoint_dir",
        "latest_checkpoint",
        "list_checkpoints",
        "load_checkpoint",
        "manifest_path",
    ),
    "trainer.train.distributed": ("local_env",),
    # scoring a drafter on held-out blocks, as training does
    "trainer.run": ("build_drafter",),
    "trainer.model.target": (
        "Target",
        "TinyTargetSpec",
        "adopt_tokenizer",
        "build_tiny_model",
        "target_from_options",
    ),
    "trainer.model.drafter": ("DFlashDrafter", "DrafterConfig"),
    "trainer.model.blocks": ("LossConfig",),
    "trainer.model.loss": ("draft_loss",),
    "trainer.train.batches": ("pad_batch",),
    # the text corpus's prompts and held-out files, in the trainer's formats
    "trainer.data.regen": ("heldout_prompts", "load_prompts", "split_prompt"),
    "trainer.data.corpus": ("write_heldout",),
    "trainer.files": ("atomic_output",),
    # vLLM, as the trainer starts and reads it
    "trainer.vllm.process": ("vllm_server",),
    "trainer.vllm.api": ("complete",),
    "trainer.vllm.metrics": ("spec_counters",),
}
