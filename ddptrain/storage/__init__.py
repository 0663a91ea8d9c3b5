"""Where a run's results go, and how they are read back.

``base`` defines ``RunStorage``, the one interface the driver and the workers write a run
through; ``local``, ``copyback`` and ``fsspec`` are its implementations, and ``open`` picks one
(the driver's from the run's config, a worker's from the ``StorageSpec`` it is sent).
``layout`` names the files of a run folder; ``lock`` keeps two drivers out of one run;
``metrics`` and ``checkpoint_manager`` write what ranks report; ``location`` decides whether a
storage path is local or an fsspec URI; ``remote``, ``remote_calls``, ``remote_uri``,
``remote_checkpoints`` and ``mirror`` put a run on an object store (every call bounded);
``read`` and ``run_files`` read runs back for ``Result.from_path``, the CLI and the dashboard.
"""
