"""The processes of a run, before and around the training: everything between the command line and a
rank's Trainer, and what stops them.

- ``preflight``: what is checked before any worker starts (config, corpus, devices, directories, the
  checkpoint to resume), so a bad input is one message and exit code 2, not a failure on every rank;
- ``launcher``: the local launcher (``launch.nproc_per_node`` workers under torch's elastic agent:
  restarts, signals, the run directory's lock, the first failure named);
- ``distributed``: joining torchrun or SLURM or the local launcher's group, and the one place that
  decides the device and the backend;
- ``stop_signals``: SIGTERM/SIGUSR1 stop every rank at the same step, after a checkpoint;
- ``worker``: a local worker's first lines (Ctrl-C while it imports ends it quietly);
- ``process_exit``: a command's and each worker's last: its exit work done, the interpreter's
  teardown skipped.
"""
