"""Separate processes, and their planning in the kernel before they start (launch side).

Options checked (``options``, ``values``, ``schedulers``), ranks placed
(``placement``), then the controller and engines started as processes
(``cluster``, ``launcher``, ``zygote``, ``guard``). Imports nothing from
:mod:`nbdist.driver`.
"""
