"""asyncrl.controllers."""
