"""The web console (issue #40): server-rendered pages in front of the runtime's API, for people
who would rather look than read JSON lines: the library, playing a task by hand, captured
episodes, a run's curriculum and the library's health."""
