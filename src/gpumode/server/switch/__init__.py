"""The switch service: every way into a switch (the REST API's switch and group routes, the dashboard's
switch and rollout confirms) goes through :mod:`.service`, which plans, stores, audits and wakes the agent.

Modules, lowest first (each imports only those above it):

- ``states``, ``errors``, ``codec``: the job's state names, the service's refusals, the stored JSON forms;
- ``planning``: an API request to the engine's request, the stored whitelist to the engine's, a plan on a
  node as it last reported itself with the cloud platform's host steps;
- ``store``: the job row (one active job per node), its end event;
- ``lifecycle``: how a row moves (ended, undo asked, cancelled, step reports folded in);
- ``rollouts``: a host group switched a few nodes at a time within a failure budget;
- ``ending``: what follows any job's end (its event, its rollout's next move);
- ``hold``: the cloud platform's hold on the node around the host steps;
- ``cloud_steps``: the server's own steps after the host's, from a registry of actions;
- ``work``: the agent's side (take a job, report the host's result, ask again);
- ``recovery``, ``metrics``: server start, ``/metrics``;
- ``service``: the entry points.
"""
