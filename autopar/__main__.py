from autopar.cli.main import run

run()
