"""An example third-party plugin for fabric-core.

Kept empty on purpose: the entry point imports ``fabric_example_plugin.register``, and anything imported here
would be paid by every ``fabric plugins`` call and every ``Fabric(...)``, even when the user never asks for
this plugin's names.
"""

__version__ = "0.3.1"
