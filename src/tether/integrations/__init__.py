"""Bridges to other libraries: their APIs (imported only when that library is installed) and their names."""
