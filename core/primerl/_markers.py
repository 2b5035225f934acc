"""The pluggy markers, in their own module so hookspecs and plugins share one project name."""

import pluggy

PROJECT = "primerl"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
