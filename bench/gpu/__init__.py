"""`blink bench gpu`: first light for the device drive modes, its phases each in a process of their own."""
