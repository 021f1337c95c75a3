"""Separate processes, and their planning in the kernel before they start (launch side).

Options checked (``options``, ``values``, ``launcher_options``), ranks placed
(``placement``), then the controller and engines started as processes
(``cluster``, with the controller's ``heartbeat``; ``local_engines`` and ``zygote`` on this
machine, ``remote_engines``, ``slurm_job``, ``ssh_engines`` and ``batch_task_engine`` through
Slurm, MPI or SSH;
``parent_watchdog`` ends the controller with its kernel). Imports nothing from
:mod:`nbdist.driver`.
"""
