"""Hook implementations: register components by name, lazily ("module:attr")."""

from primerl import hookimpl


@hookimpl
def register_envs(register):
    register("echo-digits", "primerl_echo.env:EchoDigits", description="Repeat a number back")
