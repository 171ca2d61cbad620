from app.commands.cli import exit_with, main

exit_with(main())
