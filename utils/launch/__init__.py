"""How the processes of a run are started, meet and stop: the launcher's environment (``environments``), the process
group, its collectives and the scripts' exit statuses (``process_group``), and signals (``signals``).

Nothing is imported here: the entry scripts import ``utils.launch.signals`` before torch, so that Ctrl-C during the
imports gives one line instead of a traceback.
"""
