"""blink.engine.drive: who runs the step: the Driver interface, the drive modes (host, graph, persistent), the
offline API's queue, the device step and the slot table mapped into the device."""
