"""The gateway and the client without torch: import hygiene, a torch-free gateway process, the client package."""
