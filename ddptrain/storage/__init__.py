"""Where a run's results go, and how they are read back.

``layout`` names the files of a run folder; ``lock`` keeps two drivers out of one run;
``metrics`` and ``checkpoint_manager`` write what ranks report; ``location`` decides whether a
storage path is local or an fsspec URI; ``remote``, ``remote_calls``, ``remote_uri``,
``remote_checkpoints`` and ``mirror`` put a run on an object store (every call bounded);
``read`` and ``run_files`` read runs back for ``Result.from_path``, the CLI and the dashboard.
"""
