"""OpenStack as gpumode's cloud platform: Placement (real HTTP), Nova and Cyborg (behind small interfaces).

The package root imports nothing heavy, so the server's settings can embed :mod:`.config` without the
``openstack`` extra installed; :func:`gpumode.cloud.openstack.factory.platform_factory` builds the platform
the server uses when its setting ``cloud = "openstack"``.
"""
