"""In-tree backends, one module each. Importing this package registers nothing:
the registry imports a backend's module the first time its name is asked for."""
