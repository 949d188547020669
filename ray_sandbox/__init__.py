"""ray_sandbox: isolated gVisor sandboxes for Ray programs."""
