"""Jupyter server: keep JupyterLab's kernel indicators Busy while a cell runs and widgets open.

Why: ipykernel 7 supports kernel subshells (JEP 91), and JupyterLab 4.4+ then
sends the messages of each widget target over a subshell of its own. The first
widget a cell opens (nbdist's dashboard, a progress bar) makes JupyterLab send
a ``create_subshell_request`` on the control channel; the kernel answers it
with ``status: busy`` then ``status: idle`` on IOPub, parented to that control
request, and JupyterLab takes that ``idle`` as the kernel's state: the notebook
and the status bar read Idle while the cell still runs (a cell that opens no
widget reads Busy throughout).

JupyterLab already ignores the status of the message types the server lists in
``MappingKernelManager.untracked_message_types`` (which it puts in the page
config); that list is documented as a superset of the messages sent on any
channel other than shell, and covers ``kernel_info_request``,
``debug_request``, ``interrupt_request``... but not yet the subshell requests,
which are control-channel messages too. :func:`untrack_subshell_messages`
adds them, for every kernel of the server. The list also excludes messages
from the server's idle-culling activity, where control messages have no place
either.

Example::

    >>> from nbdist.server.busy import SUBSHELL_MESSAGE_TYPES
    >>> "create_subshell_request" in SUBSHELL_MESSAGE_TYPES
    True
"""

from __future__ import annotations

__all__ = ["SUBSHELL_MESSAGE_TYPES", "untrack_subshell_messages"]

# JEP 91's control-channel messages (requests and replies).
SUBSHELL_MESSAGE_TYPES = (
    "create_subshell_request",
    "create_subshell_reply",
    "delete_subshell_request",
    "delete_subshell_reply",
    "list_subshell_request",
    "list_subshell_reply",
)


def untrack_subshell_messages(serverapp) -> list[str]:
    """Add :data:`SUBSHELL_MESSAGE_TYPES` to the server's untracked message types.

    Updates ``serverapp.kernel_manager.untracked_message_types`` (read by
    JupyterLab's server extension when it loads after this one) and the page
    config JupyterLab already built from it (when it loaded before: extensions
    load in alphabetical order, so ``jupyterlab`` comes before ``nbdist.server``
    and ``notebook`` after it). A list the user configured keeps its entries.
    Returns the new list.
    """
    manager = serverapp.kernel_manager
    current = list(getattr(manager, "untracked_message_types", None) or [])
    merged = current + [t for t in SUBSHELL_MESSAGE_TYPES if t not in current]
    if hasattr(manager, "untracked_message_types"):
        manager.untracked_message_types = merged
    page_config = serverapp.web_app.settings.setdefault("page_config_data", {})
    known = list(page_config.get("untracked_message_types") or [])
    page_config["untracked_message_types"] = known + [t for t in merged if t not in known]
    return merged
